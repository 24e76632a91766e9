"""Run directory: layout (path templates), record schema, append-only writer and tolerant reader."""
