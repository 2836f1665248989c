// expect: no matching function for call to '.*archetypes::communicator::allreduce
// The communicator concept lists the element types collectives move; an exchange that reduces
// another type (here int) fails the archetype instantiation, although mpi_comm and
// in_process_comm would happen to accept it.
#include <span>
#include <vector>

#include <gradcomp/concepts.hpp>

struct counting_exchange {
  template <class C, class Comm>
  gradcomp::exchange_stats exchange(Comm& comm, const C&, const gradcomp::payload&,
                                    std::span<typename C::value_type>) {
    std::vector<int> counts(1, 0);
    comm.allreduce(std::span<int>(counts), gradcomp::reduce_op::sum);
    return {};
  }
};

static_assert(gradcomp::archetypes::instantiates<counting_exchange, false>);
