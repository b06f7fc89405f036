"""Per-architecture declarations: attention roles, processors and block topology."""
