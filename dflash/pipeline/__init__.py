"""The asyncio pipeline: one coroutine per stage (`dflash/stages/`), wired by `topology`, run by the
`Coordinator` (`runner.run` gives it its own loop); `serial` is the same stage functions in
one plain loop. Only the top (`dflash`, `cli`) imports it."""
