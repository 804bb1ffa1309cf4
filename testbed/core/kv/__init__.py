"""The KV transfer wire protocol, I/O-free: the frame codec and the sender's and receiver's state
machines."""
