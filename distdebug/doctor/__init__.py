"""Environment checks (``distdebug doctor``), also run inside every rank by attach's env_check."""
