"""The books: one durable row per request, shipped from a local spool to SQLite or PostgreSQL."""
