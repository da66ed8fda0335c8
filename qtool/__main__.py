from qtool.cli.main import console

console()
