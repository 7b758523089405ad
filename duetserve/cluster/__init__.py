"""Scale-out on Ray (`duet cluster`): Ray places and supervises duetserve instances across
nodes; the router in front learns them from the controller.

    instance.py     ServerInstance, the Ray actor: one `duet serve` (engine + HTTP app) in
                    its worker process on its node, on a port of its own; info(), drain()
    controller.py   Controller: starts and stops the actors (resources, max_restarts) and
                    keeps the router's pool in step: registration, a restarted instance's
                    new URL, deregistration after a drain-first removal
    admin.py        the /cluster routes (list, add, drain-and-remove) on the router app
    cli.py          `duet cluster`, the Ray driver: flags, Ray connection, the router

Ray carries control messages only (create, info, drain, kill); requests reach each
instance over HTTP and the KV bytes go through the instances' transfer backend (Mooncake
over TCP across hosts), never through Ray's object store.
"""
