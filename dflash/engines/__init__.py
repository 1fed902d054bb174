"""Serving engines at both ends: vLLM running an export as drafter (`vllm`), the target's
features from vLLM (`extract`), and regen's repliers behind one face (`replier`): the target's
own loop (`local`), vLLM's offline API (`replies`) and an OpenAI-compatible chat server
(`server`)."""
