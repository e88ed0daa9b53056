"""The KV layer: page pools and copies, backends, plans, the stateless KVCacheManager and the
worker-side plan path, the legacy path, and the gate that picks one."""
