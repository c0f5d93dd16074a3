# Sourced by the benchmark scripts: makes `import mars_plugin` (with mars_plugin.adapters) work
# from this checkout without installing it and without writing into it (a bare GPU machine has
# torch but not this package): a temporary folder holds a mars_plugin/ of links to the checkout's
# modules plus adapters/, and goes first on PYTHONPATH. Removed when the script exits.
_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_view="$(mktemp -d)"
trap 'rm -rf "$_view"' EXIT
mkdir "$_view/mars_plugin"
for _f in "$_repo"/mars_plugin/*; do
  [ "$(basename "$_f")" = adapters ] || ln -s "$_f" "$_view/mars_plugin/"
done
ln -s "$_repo/adapters" "$_view/mars_plugin/adapters"
export PYTHONPATH="$_view${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
