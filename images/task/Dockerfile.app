# The task runtime: the runtime's packages (images/task/Dockerfile.runtime) with the project's own code under
# $PREFIX/app (the task runner, the shim, the harness adapters). Built by dispatcher.images for every change to that
# code; task images copy only $PREFIX/app from it, as a layer of its own.
ARG PACKAGES_IMAGE
FROM ${PACKAGES_IMAGE}
ARG PREFIX=/opt/evalplane
COPY src/ ${PREFIX}/app/
RUN chmod 0755 "$PREFIX/app/harness/prune_history.sh" \
 && "$PREFIX/bin/python3" -m compileall -q "$PREFIX/app" \
 && "$PREFIX/bin/python3" -c "import harness.task, shim.server, contract.aws" \
 && test -x "$PREFIX/bin/prune-history"
