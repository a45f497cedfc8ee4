"""Node service: shard slots, KV-cache sessions, doctor, heartbeat loop."""
