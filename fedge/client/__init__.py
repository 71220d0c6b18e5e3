"""Client side: mods, training, the device agent, ONNX Runtime inference."""
