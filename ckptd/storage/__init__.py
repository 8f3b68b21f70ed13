"""Where checkpoints are kept: local disk (:mod:`.local`), an object store (:mod:`.remote` over the
:class:`~ckptd.storage.store.ObjectStore` protocol, implemented for S3 by :mod:`.s3`), and which
steps each keeps (:mod:`.retention`). Blocking I/O throughout: the daemon calls it from its worker
threads. Nothing here imports torch or zmq."""
