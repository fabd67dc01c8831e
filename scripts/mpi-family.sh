# Which MPI family an mpicc or a parallel HDF5 belongs to, from the MPI library it links
# (sourced by scripts/setup.sh; bash functions only). Families are ABIs: a program built
# against one runs only with a library of the same family.
#   openmpi  libmpi.so.20 / .40 (Open MPI 2-5)
#   mpich    libmpich.so.12, libmpi.so.12, libmpi_cray.so.12 (MPICH, Cray MPICH, Intel MPI,
#            MVAPICH: the MPICH ABI)
# "unknown" when nothing links dynamically (a static Cray build): set-up then trusts the site.

mpi_family_of_libs() {  # stdin: ldd output -> openmpi | mpich | unknown
  local libs
  libs=$(grep -oE 'lib(mpi|mpich|mpi_cray|mpi_gnu_[0-9]+)\.so\.[0-9]+' | sort -u || true)
  case "$libs" in
    *libmpich.so.12*|*libmpi.so.12*|*libmpi_cray.so.12*|*libmpi_gnu_*) echo mpich ;;
    *libmpi.so.*) echo openmpi ;;
    *) echo unknown ;;
  esac
}

mpi_family_name() {  # family -> words for messages
  case "$1" in
    openmpi) echo "Open MPI" ;;
    mpich) echo "the MPICH ABI (MPICH, Cray MPICH, Intel MPI, MVAPICH)" ;;
    *) echo "an unknown MPI" ;;
  esac
}

mpicc_family() {  # MPICC -> family of the library a program built by it links
  local dir rc=0
  dir=$(mktemp -d)
  printf '#include <mpi.h>\nint main(int c, char **v) { MPI_Init(&c, &v); MPI_Finalize(); return 0; }\n' \
    > "$dir/probe.c"
  if "$1" "$dir/probe.c" -o "$dir/probe" >/dev/null 2>&1; then
    ldd "$dir/probe" 2>/dev/null | mpi_family_of_libs
  else
    rc=1
  fi
  rm -rf "$dir"
  return $rc
}

hdf5_family() {  # HDF5 prefix -> family of the MPI its libhdf5 links
  local lib
  for lib in "$1/lib/libhdf5.so" "$1/lib64/libhdf5.so" "$1/libhdf5.so"; do
    if [ -e "$lib" ]; then
      ldd "$lib" 2>/dev/null | mpi_family_of_libs
      return 0
    fi
  done
  echo unknown
}

hdf5_is_parallel() {  # HDF5 prefix -> status 0 when built with MPI (libhdf5.settings)
  local s
  for s in "$1/lib/libhdf5.settings" "$1/lib64/libhdf5.settings" "$1/libhdf5.settings"; do
    [ -f "$s" ] && { grep -qiE 'Parallel HDF5: *yes' "$s"; return; }
  done
  return 0  # no settings file: let h5py's build decide
}
