"""Analysis: run directory in, verdicts out (load -> match -> verdict); no presentation here."""
