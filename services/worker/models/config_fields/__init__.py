"""How config.json maps onto the decoder's fields, by the traits families share (a family's own
knowledge is its record in models/families/)."""
