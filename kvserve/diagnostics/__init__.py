"""Tools that explain the engine's resource use without running a model (`kvserve memory`)."""
