"""Target features kept for later: the in-memory per-sample cache (`cache`) and regen's
feature files (`files`) that seed it."""
