"""The router's control loops: the short-term bandwidth controller and what drives it, the
long-term role loop and its role slots."""
