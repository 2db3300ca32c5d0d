"""Speculative decoding as one plug-in: the drafter, the draft-length policy and its step costs (``decoder``)."""
