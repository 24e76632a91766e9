"""Environment checks (``distdebug doctor``), also made by attach's launcher on each node
(env_check) before its ranks start."""
