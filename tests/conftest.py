"""Suite-wide settings: no telemetry, offline dataset libraries, a fresh partition cache."""

import os
import tempfile

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Partition caches of this run only (agent subprocesses inherit it).
os.environ.setdefault("FEDGE_CACHE_DIR", tempfile.mkdtemp(prefix="fedge-test-cache-"))
