"""The coordinator's HTTP contract, spoken by both ends (docs/protocol.md).

protocol.py (the pydantic schemas of every request and answer), errors.py (one class per refusal,
each with its HTTP status), validate.py (what a record, a body or a logged string may look like at
the door; pure), identity.py (worker credentials, the learner key's fingerprint, the relay-address
rule; pure) and client.py (`CoordinatorClient`, the one client of the API). Sits below both the
coordinator and the worker; imports only config, records and aio.
"""
