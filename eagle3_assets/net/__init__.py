"""What every stage that talks to a server shares (Dagster-free; below the stages, above ``core``): the endpoint pool
(routing, caps, benches), credentials in URLs, free ports, reply bodies bounded in time and size (``bounded_http``)
and the size a reply may have (``reply_limits``).
"""
