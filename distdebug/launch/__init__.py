"""Launching: attach (torch's elastic launcher as a library), rank bootstrap, run manifest."""
