"""The web inspector: browse the exact samples each rank receives, in a browser.

An aiohttp route set mounted at `/ui` on the sidecar's metrics port (never on the
control socket), and served alone by `shardcache web URI`. Read-only: GET routes over
`shardcache.inspect`; the page is static HTML/JS/CSS shipped in this package, so
nothing is fetched from elsewhere. It shows the dataset's public URI (no user info or
query string), never environment, settings or credentials.
"""
