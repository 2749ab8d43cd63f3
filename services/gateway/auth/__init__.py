"""Who may call the gateway, as whom, and how much: API keys (`keys`), per-tenant limits
(`limits`), the gate both front ends pass (`gate`) and its HTTP middleware (`http`)."""
