"""MQTT transport: reliable channel, broker helpers, lossy-link proxy."""
