"""MQTT transport: reliable channel, Flower Grid over MQTT, broker helpers, lossy-link proxy."""
