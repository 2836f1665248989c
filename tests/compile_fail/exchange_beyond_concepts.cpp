// expect: archetypes::compressor<false>' has no member named 'selector'
// An exchange whose signature models the concept but whose body uses something the concepts
// do not promise (here the compressor's selector) passes the signature check and compiles
// against compressor<>, yet fails the archetype instantiation that follows every exchange.
#include <span>

#include <gradcomp/concepts.hpp>

struct peeking_exchange {
  template <class C, class Comm>
  gradcomp::exchange_stats exchange(Comm&, const C& c, const gradcomp::payload&,
                                    std::span<typename C::value_type>) {
    (void)c.selector();
    return {};
  }
};

static_assert(gradcomp::exchange<peeking_exchange, gradcomp::archetypes::compressor<false>,
                                 gradcomp::archetypes::communicator>);
static_assert(gradcomp::archetypes::instantiates<peeking_exchange, false>);
