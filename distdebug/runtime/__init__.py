"""Per-rank runtime: the Session that turns the user's own training loop into step events."""
