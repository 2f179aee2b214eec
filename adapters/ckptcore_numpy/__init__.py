"""The reference adapter: plain NumPy models, the smallest framework ckptcore supports.

Placeholder while the reference adapter is being written; it registers nothing usable yet.
"""
