from batchbound.cli import main

raise SystemExit(main())
