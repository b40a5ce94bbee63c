"""Replicas of the engine on Ray Serve behind a prefix-aware router (`kvserve serve --replicas N`)."""
