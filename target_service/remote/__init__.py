"""The target's side of the pooled speculation endpoint: a drafter whose drafts come over the wire
(drafter.py), on one stream and tensor channel (connection.py), with per-sequence sessions (sessions.py)
and SSD's pushed outcome tables (ssd_push.py), failing open to local n-gram drafting (fallback.py);
wire.py builds its messages and reads the replies into typed rows, codec.py checks the drafts and
assembles them for verification; observer.py turns what it reports into this service's metrics."""
