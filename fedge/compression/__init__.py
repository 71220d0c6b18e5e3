"""Update compression: sparsifiers, quantizers, error feedback and the wire format (pure numpy)."""
