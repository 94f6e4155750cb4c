"""Peer-assisted snapshot broadcast: chain plans and scores, signed chunk format, rate limiting,
chunk streams and relays.

plan.py (pure: scores, N_ch, chains, broadcast-time formulas), chunks.py (format, signed manifest,
verification), bucket.py (token bucket), stream.py (chunk-stream framing), relay.py (`ChunkStore`,
`RelayServer`), meter.py (a parent's delivered rate). It imports nothing from control/, which
builds on it: the receiving client (it talks to the coordinator) and the broadcast-only peer (a
worker) are rollout/broadcast_client.py and rollout/broadcast_peer.py. Imports no torch: it moves
and checks bytes, and knows no model.
"""
