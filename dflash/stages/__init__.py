"""Pipeline stages, one module each. Each is a coroutine that takes from its inbox, does
its work on its Device (never on the event-loop thread), and puts into its outbox, until
the inbox ends; then it closes its outbox. A stage imports no other stage, and only
`dflash/pipeline/` imports the stages.

    prefetch ─► target_forward ─► pack ─► transfer (D2H) ─► [hidden-state channel]
        ─► drafter_step × M replicas ─► optimizer (reduce, clip, step; replies to replicas)
"""
