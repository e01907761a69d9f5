"""The status page (`--dashboard PORT`): a small aiohttp server and one static page."""
