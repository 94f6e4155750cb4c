"""The `skypilot` provider: provider.py (slots, start, stop), task.py (the task of one worker; pure),
client.py (the SDK boundary and `BridgeClient`) and bridge.py (run by SkyPilot's own interpreter,
which echo2 never imports: stdlib and sky only).
"""
