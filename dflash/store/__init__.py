"""Files: the one way a file or folder is put in place (`atomic`), and files inside installed
packages (`packages`). Imported by every layer above; imports none of them."""
