import os

# Two cores: one thread per rank, and gloo on loopback.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
