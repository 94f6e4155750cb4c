"""Peer-assisted snapshot broadcast: chain plans and scores, signed chunk format, rate limiting,
chunk streams, relays and the receiving client.

plan.py (pure: scores, N_ch, chains, broadcast-time formulas), chunks.py (format, signed manifest,
verification), bucket.py (token bucket), stream.py (chunk-stream framing), relay.py (`ChunkStore`,
`RelayServer`), client.py (`BroadcastClient`). The broadcast-only peer is a worker, so it lives in
rollout/broadcast_peer.py. Imports no torch: it moves and checks bytes, and knows no model.
"""
