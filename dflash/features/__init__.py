"""Target features kept for later: the in-memory per-sample cache (`cache`), the feature files
that regen and `dflash features` write (`files`), and those features computed by vLLM's
`extract_hidden_states` (`vllm`; its connector, `hidden_states`, is imported by vLLM by name)."""
