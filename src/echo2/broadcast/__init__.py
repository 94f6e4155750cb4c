"""Peer-assisted snapshot broadcast: chain plans and scores, signed chunk format, rate limiting,
chunk streams and relays.

plan.py (pure: scores, N_ch, chains, broadcast-time formulas), chunks.py (format, signed manifest,
verification), bucket.py (token bucket), stream.py (chunk-stream framing), relay.py (`ChunkStore`,
`RelayServer`), meter.py (a parent's delivered rate); and the learner's bookkeeping of a broadcast: tracker.py
(kept snapshots, chain plans, scores, T_bcast; pure), credits.py, transfers.py, installs.py and
blob.py. It imports nothing from coordinator/, which builds on it: the receiving client (it talks to the coordinator) and the broadcast-only peer (a
worker) are rollout/broadcast_client.py and rollout/broadcast_peer.py. Imports no torch: it moves
and checks bytes, and knows no model.
"""
