"""The reference Flower app (ServerApp, ClientApp) and its pluggable task."""
