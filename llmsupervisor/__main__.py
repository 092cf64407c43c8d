from llmsupervisor.cli import main

raise SystemExit(main())
