"""What the router does per request, I/O-free: its books, one routing step, retries, health and
request ids. Built on routing and control."""
