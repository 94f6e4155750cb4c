"""Peer-assisted snapshot broadcast: chain plans and scores, signed chunk format, rate limiting."""
