from skulkp2p.cli import main

raise SystemExit(main())
