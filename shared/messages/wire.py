"""How every wire message is encoded: msgpack arrays (fields by position), defaults left out,
no GC tracking (they hold no cycles)."""

WIRE = dict(array_like=True, omit_defaults=True, gc=False)
