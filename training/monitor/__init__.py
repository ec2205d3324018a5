"""`ttt monitor`: the run's monitor peer, with its history, checkpoints and dashboard.

    run.py        the monitor: reads every peer's record, keeps the history, takes checkpoints, serves the pages
    aggregate.py  the swarm's state from the records of one read
    history.py    the run's history in SQLite
    report.py     the dashboard's JSON and the Prometheus text
    server.py     the HTTP server: the dashboard, the Join page, /api/state, /api/calc, /metrics
    snapshots.py  the monitor's copy of the run's model: downloads, checkpoints, previews, pushes to the Hub
    coverage.py   the swarm's data epoch, as the peers' leases say
    verified.py   verified credit: what the audits say of each peer's work
    revocation.py --revoke-convicted: revoke the users the audits convict (an authenticated run)
    status.py     `ttt status`: a run at a glance from its swarm, without a monitor
    wheel.py      the wheel of this ttt that the Join page's install line points to
    static/       the dashboard and the Join page (plain HTML, CSS and JavaScript; uPlot vendored)
"""
