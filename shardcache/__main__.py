from shardcache.cli import main

raise SystemExit(main())
