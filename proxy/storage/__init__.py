"""Where the proxy keeps things and how it talks to the stores, said once for every wing that
stores: the budget's Redis, the cache's Redis, the ledger's and the capture store's SQLite or
PostgreSQL. `urls` reads a store URL (its dialect, its file, its cluster form, its shown form)
and names the state directory; `sql` writes a statement's placeholders in a dialect; `pg`
holds a PostgreSQL connection that opens itself again after it breaks.

Below the configuration, which validates the URLs it reads with `urls`; split in modules so
that a part that only reads a URL (the budget, the cache) does not load asyncpg.
"""
