"""Peer-assisted snapshot broadcast: chain plans and scores, signed chunk format, rate limiting,
chunk streams, relays, the receiving client and the broadcast-only peer.

plan.py (pure: scores, N_ch, chains, broadcast-time formulas), chunks.py (format, signed manifest,
verification), bucket.py (token bucket), stream.py (chunk-stream framing), relay.py (`ChunkStore`,
`RelayServer`), client.py (`BroadcastClient`), peer.py (`BroadcastPeer`, `python -m
echo2.broadcast.peer`). Imports no torch: it moves and checks bytes, and knows no model.
"""
